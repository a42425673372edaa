"""weightcache.daemon: loads a model once into sealed slabs and serves them to engines.

checkpoint.py reads and validates the model, layout.py plans the slabs, backends/ hold
the memory, loader.py fills it, server.py answers engines, service.py runs the whole.
"""
