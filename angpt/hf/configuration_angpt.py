"""Hugging Face configuration of anGPT and nGPT exported by angpt (tools/convert_to_hf.py).

Self-contained (only `transformers`): it is copied next to the weights of every exported model. The
fields name the switches of angpt's docs/model.md (Families and switches); the constant normalization
factors are folded into the scale multipliers and weights by the converter (`folded_factors` records those
in weights).
"""

from transformers import PretrainedConfig


class AnGPTConfig(PretrainedConfig):
    model_type = "angpt"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        model_family="angpt",
        post_norm="l2",
        residual="lerp",
        nu_alpha_mode="analytic",
        nu_alpha_multiplier=1.0,
        nu_alpha_plain=0.7071067811865476,
        alpha_abs=False,
        scale_multipliers=None,
        folded_factors=None,
        angpt_args=None,
        use_cache=True,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # "angpt" or "ngpt": nGPT has one s_qk per head (docs/model.md, nGPT), anGPT one shared by all heads.
        self.model_family = model_family
        # Norm(x) on each sub-block output ("l2") or nothing ("none").
        self.post_norm = post_norm
        # The residual update: LERP with alpha ("lerp") or the plain sum ("plain").
        self.residual = residual
        # What follows each residual update: nu(alpha) ("analytic"), nothing ("one"), or 1/||x|| ("exact").
        self.nu_alpha_mode = nu_alpha_mode
        self.nu_alpha_multiplier = nu_alpha_multiplier
        # nu of the plain residual h + x (docs/model.md, Normalization factors).
        self.nu_alpha_plain = nu_alpha_plain
        self.alpha_abs = alpha_abs
        # Each learnable scale is stored as its surrogate s_hat and used as s = multiplier * s_hat, with
        # multiplier = s_init / s_scale (docs/model.md, Learnable scales), exactly as in training.
        self.scale_multipliers = scale_multipliers or {"alpha": 1.0, "s_qk": 1.0, "s_u": 1.0, "s_v": 1.0, "s_z": 1.0}
        # What the converter multiplied each weight by (documentation, and undone by convert_from_hf.py).
        self.folded_factors = folded_factors or {}
        # The angpt training flags of the model's shape and switches.
        self.angpt_args = angpt_args or {}
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
