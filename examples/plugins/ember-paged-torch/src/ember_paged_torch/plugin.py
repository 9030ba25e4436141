"""Registration only: names, "module:attr" paths and static capabilities. No torch import here:
`ember plugins` imports this module to list what the plugin provides."""

from ember.plugins import hookimpl


@hookimpl
def ember_register_attention_backends(registry):
    registry.register_backend(
        "paged_torch",
        "ember_paged_torch.backend:PagedTorchBackend",
        devices=["cpu", "cuda"],
        dtypes=["float32", "float16", "bfloat16"],
        head_sizes="any",
        sliding_window=True,
        cuda_graphs=False,
        priority=-10,  # a teaching example: never chosen over the built-ins unless asked for
    )
