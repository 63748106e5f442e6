"""kvfleet. Every import name of the project lives under this one: the folders gateway/, worker/,
shared/ and batch/ are the packages kvfleet.gateway, kvfleet.worker, kvfleet.shared and
kvfleet.batch (no top-level `worker` or `shared` to collide with another distribution's).

An installed wheel holds them inside kvfleet/ (setup.py maps each folder there). A source
checkout, or an image that runs the tree as it is, has them beside this folder: the package's
search path then reaches them there, and only them (SUBPACKAGES)."""

from __future__ import annotations

from pathlib import Path

SUBPACKAGES = ("gateway", "worker", "shared", "batch")

_here = Path(__file__).resolve().parent
if not any((_here / name).is_dir() for name in SUBPACKAGES):
    from kvfleet._checkout import CheckoutFinder

    CheckoutFinder.install(__name__, _here.parent, SUBPACKAGES)
