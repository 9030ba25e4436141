"""Example ember plugin: a pure-torch paged attention backend. Kept empty so that listing
plugins imports nothing but ``ember_paged_torch.plugin``."""
