"""The logical-axis vocabulary shared by models, rules and shape comments.

Every parameter and key activation names its dimensions with these strings;
`partitioning` maps them to mesh axes through logical-axis rules. Keep the
list short: a new name is a new thing every rule set must decide about.
"""

BATCH = "batch"  # examples in a batch
LENGTH = "length"  # sequence positions
EMBED = "embed"  # model width (d_model)
HEADS = "heads"  # attention heads
KV = "kv"  # per-head width (d_kv)
MLP = "mlp"  # feed-forward hidden width
VOCAB = "vocab"  # token embedding rows / logits
RELPOS_BUCKETS = "relpos_buckets"  # relative-position bias buckets
EXPERT = "expert"  # Mixture-of-Experts expert index
EXPERT_MLP = "expert_mlp"  # feed-forward hidden width inside an expert
LAYERS = "layers"  # stacked layers when scanning over depth
