from mlx_lm.models import kimi_k3
def cfg(H=256, L=8, E=16, K=4, inter=32, latent=128, V=3072, heads=4, hd=32, kda=(1,2,3,5,6,7)):
    return dict(model_type="kimi_k3", vocab_size=V, hidden_size=H, num_hidden_layers=L,
        num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=4*H//2,
        linear_attn_config=dict(num_heads=heads, head_dim=hd, short_conv_kernel_size=4, kda_layers=list(kda),
            full_attn_layers=[i for i in range(1,L+1) if i not in kda], gate_lower_bound=-5.0, use_full_rank_gate=False),
        activation_situ_beta=2.0, activation_situ_linear_beta=4.0, attn_res_block_size=2, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_use_output_gate=True,
        num_experts=E, num_experts_per_token=K, num_shared_experts=1, moe_intermediate_size=inter,
        routed_scaling_factor=1.0, first_k_dense_replace=1, routed_expert_hidden_size=latent,
        latent_moe_use_norm=True, tie_word_embeddings=True)

