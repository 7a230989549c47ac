"""Tokens and text: tokenizers, chat templates, incremental detokenizing and stop strings, the
request's sampling and structured-output options."""
