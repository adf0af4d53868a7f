"""Every algorithm default, defined once.

The pure-tensor functions (signatures fixed by SPEC) and the config dataclasses both read these
names, so a default changes in exactly one place. Values are the authors' reference config
(SPEC "[ref]").
"""

# Capability tracker
CAPABILITY_WINDOW = 5
CAPABILITY_METRIC = "positive_rate"
CAPABILITY_METRICS = ("positive_rate", "reward_mean")
CAPABILITY_MINIMUM = 1e-8
RATIO_MIN = 0.1
RATIO_MAX = 10.0

# Advantages
ADV_EPS = 1e-6
CROSS_BASELINES = ("learner", "source")

# GSPO self clip (sequence ratio) and log-ratio clamp
SELF_CLIP_LOW = 3e-4
SELF_CLIP_HIGH = 4e-4
MAX_ABS_LOG_RATIO = 10.0

# Cross-agent objective
ALPHA = 1.0
CROSS_CLIPS = ("stepwise", "static", "none")
CROSS_CLIP = "stepwise"
CROSS_CLIP_DELTA = 0.2
CROSS_CLIP_STEP = 0.025

# GRPO token-level clip (DAPO-style asymmetric)
GRPO_CLIP_LOW = 0.2
GRPO_CLIP_HIGH = 0.28
# GRPO's token log-ratio clamp [ours; verl's value]: SPEC's +-10 is for the sequence ratio
GRPO_MAX_ABS_LOG_RATIO = 20.0

# KL to a reference policy (self samples only); the paper's runs used 0.001
KL_COEF = 0.0

# float32's range: omega (the capability coefficient) and sampling's logits / temperature are
# float32, so settings past it would be 0 or inf there
FLOAT32_TINY = 1.1754943508222875e-38   # smallest normal number
FLOAT32_MAX = 3.4028234663852886e38
