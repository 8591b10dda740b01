"""The static `pins` check: an image's files, read from its layers, against its lock (nothing of the image runs)."""
