"""The configuration: every YAML key with its reload class (schema.py), the bounded strict loader
(loader.py), the reload-class table (reloading.py), checks that need the plan or the file system
(checks.py), the commented example (example.py) and config -> plan (planning.py)."""
