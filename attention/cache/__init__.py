"""KV-cache kernels: write new K/V rows into pooled caches (``scatter``) and
new tokens into paged caches (``paged``)."""
