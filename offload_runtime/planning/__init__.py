"""Planning batch decoding: MoE-Lightning's HRM (a roofline model of offloaded decoding with its
turning and balance points, hardware profiles, the policy search with F_g either way) and
Klotski's planner (the smallest group size meeting its inequalities 4-7 from measured times)."""
