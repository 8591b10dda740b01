"""Gates: the probe, model fixtures, reference bundles and (later) comparison, tolerances and verdicts."""
