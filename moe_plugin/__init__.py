"""Not a package of the distribution: it makes moe_plugin.tests importable by name, which the
kit's rank pools need to run a test module's functions in their ranks."""
