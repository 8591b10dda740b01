"""Publishing: push a gated image by digest with its verification record, verify a reference, the local registry."""
