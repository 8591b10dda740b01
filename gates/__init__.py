"""The gate side: reference bundles and fixtures, the static integrity check, the probe run, comparison, tolerances,
verdicts, reports, the serve check and calibration."""
