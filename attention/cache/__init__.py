"""KV-cache kernels: write new K/V rows into pooled caches (``scatter``) and
new tokens into paged caches (``paged``), and quantize new tokens into fp8 (e4m3)
caches with their scales (``fp8``)."""
