"""The batch API's back end: batch and file records in Redis, the rq jobs that feed a batch's lines
to the gateway, and the batch worker process."""
