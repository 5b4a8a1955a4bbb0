"""The DualPath testbed: emulated fabric, node processes, experiments (`from testbed import Testbed`)."""


def __getattr__(name: str):
    # Lazily: `import testbed.cli` (every CLI start) should not pay for the API's imports.
    if name in ("Testbed", "TestbedError"):
        from testbed import api

        return getattr(api, name)
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
