"""The one room for HTTP: a shared transport (clients/transport.py) and the clients on it: package indexes
(clients/pypi.py), OCI registries (clients/oci.py) and the serve check's OpenAI-compatible client (clients/openai.py)."""
