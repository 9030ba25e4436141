"""Registration only (no torch): the platform with a cheap probe, and its attention backend."""

from ember.plugins import hookimpl


@hookimpl
def ember_register_platforms(registry):
    registry.register_platform(
        "cpu_variant",
        "ember_cpu_variant.platform:CpuVariantPlatform",
        probe="ember_cpu_variant.probe:available",  # checked without importing the platform
        device_type="cpu",
    )


@hookimpl
def ember_register_attention_backends(registry, api_version):
    # `api_version` is optional in a hookimpl; here it only shows how a plugin could check it.
    if api_version < 1:
        raise RuntimeError(f"ember plugin API v{api_version} is too old for ember-cpu-variant")
    registry.register_backend(
        "cpu_variant_sdpa",
        "ember_cpu_variant.backend:CpuVariantBackend",
        devices=["cpu_variant"],  # a platform name: this backend runs on this platform only
        dtypes=["float32", "float16", "bfloat16"],
        head_sizes="any",
        sliding_window=True,
    )
