"""The seed designs, kept as readable references and as carriers of planted
defects (README.md in this folder gives each one's speed against the product
path). The product path never imports from here.

    warp_decode   one warp per (head, sequence), the reference design's decode
    split_decode  split-KV over warp chunks + combine, and the ``method=`` dispatcher
"""
