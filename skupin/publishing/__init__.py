"""Publishing: push a gated image by digest with its signed attestation, the policy publish and verify share,
verify a reference, the local registry."""
