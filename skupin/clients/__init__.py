"""The one room for HTTP: a shared transport (transport.py) and the clients on it: package indexes (pypi.py), OCI
registries (oci.py) and the serve check's OpenAI-compatible client (openai.py)."""
