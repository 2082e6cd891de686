"""The building blocks of a model on the paged runtime: attention over the KV cache, sampling."""
