"""The configuration: every YAML key (schema.py), the bounded loader, the commented example
(example.py) and config -> plan (planning.py)."""
