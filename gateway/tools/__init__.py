"""Tool calling: the call formats of the common model families, their parsers (whole and
streamed), how tools reach the prompt, and the grammars that force a call."""
