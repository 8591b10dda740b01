"""The catalog model: manifests and their grammar, accelerator families, pin compatibility, lock files and the resolved stack."""
