"""MoE-Lightning's HRM: a roofline performance model of offloaded decoding, hardware profiles
(presets or measured) and the search for the policy that maximises throughput."""
