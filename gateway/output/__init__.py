"""One choice's output as the client sees it: token events in order (sequencer, gap fill), text
(incremental detokeniser), cut where the worker stopped it (the gateway renders stops, it does
not decide them)."""
