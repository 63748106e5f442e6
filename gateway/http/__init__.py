"""The HTTP plumbing under every route package: errors in OpenAI's shape and the handlers that
make every failure one of them (`errors`), and X-Request-Id in and out (`request_id`)."""
