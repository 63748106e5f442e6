"""Code both sides of kvfleet import: settings, Redis key names, message types, model loading."""
