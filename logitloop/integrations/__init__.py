"""Adapters to other tools, each behind an optional extra and imported only when used
(`logitloop.integrations.ray`: batch jobs on Ray Data). Each is a thin layer over the public
API (`generate_many`, `score`): no second copy of batching, stops or scoring."""
