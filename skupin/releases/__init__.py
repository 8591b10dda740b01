"""Point releases: watch the indexes for releases the update policies allow, refresh the compatibility data."""
