"""The build side: manifests, pin compatibility, locks, Dockerfile rendering, wheels, bases and image builds."""
