"""The harness every measurement runs on: the fetch-and-cache helpers (`fetch`), the
models (`models`) and corpora (`corpora`) they bring, the quantized transformers
cache (`kv_cache`) and the perplexity protocols (`perplexity`)."""
