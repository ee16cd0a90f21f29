"""The role plugtron-moe adds to the core's (entry-point group ``plugtron.roles``): token
dispatchers, found by name in their own group like the core's drivers, and collected for their
options and checks whether a run selects them or not; ``plugtron plugin new moe_dispatcher
NAME`` starts one from this package's template."""

from plugtron.api import PluginRole

DISPATCHER = PluginRole("plugtron.moe_dispatchers", "MoE token dispatch and combine",
                        always_collected=True, template="plugtron_moe:templates/dispatcher",
                        template_test_requires=("plugtron-moe", "plugtron-gpt"))
