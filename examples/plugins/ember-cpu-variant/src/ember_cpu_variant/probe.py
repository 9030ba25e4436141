"""The platform's probe: cheap, no torch. Availability is opt-in through EMBER_CPU_VARIANT=1."""

import os


def available():
    if os.environ.get("EMBER_CPU_VARIANT") == "1":
        return True, ""
    return False, "set EMBER_CPU_VARIANT=1 to enable this example platform"
