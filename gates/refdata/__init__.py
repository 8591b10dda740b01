"""Reference data: model fixtures, reference bundles, GGUF conversion, tensor files and the probe's output, all read bounded."""
