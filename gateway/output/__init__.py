"""One choice's output as the client sees it: token events in order (sequencer, gap fill), text
(incremental detokeniser) and stop strings."""
