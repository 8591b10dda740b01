"""An image's files read from its layers on the host (nothing in the image runs): layer tars and Debian's package records."""
