"""A Qwen2-VL / Qwen2.5-VL / Qwen3.5 model for packed batches: transformers' vision tower, packfwd's Megatron-Core
language model.

:class:`VisionLanguageModel` takes the call ``make_forward(vision=True)`` (and ``packfwd.verl``'s vision forward)
makes (:mod:`packfwd.forward.vision`): the batch as the caller laid it out, the images, and the ``packing`` hook.
Its forward, per batch:

1. the token embeddings ``[b, s, h]`` of the language model's own (vocab-parallel) embedding;
2. the vision tower's features (``visual(pixel_values, grid_thw=image_grid_thw)``, transformers' module, merger
   included) put in place of the image tokens, row after row, as Qwen2-VL does (``masked_scatter``); the same for
   videos;
3. the multimodal RoPE positions ``[3, b, s]``: the caller's, else :func:`packfwd.vision.mrope_position_ids`
   (transformers' ``get_rope_index`` values);
4. ``packing.embeddings`` / ``packing.positions``: both in this rank's layout with the batch's plan (THD: this CP
   rank's zigzag share; image tokens go where their sequence's tokens go);
5. the language model (:func:`packfwd.models.convert.hf_vl.language_model_from_hf`, ``position_embedding_type="mrope"``) on
   ``decoder_input``, returning ``[1, t, v]`` (THD) or ``[b, s_c, v]`` (BSHD).

Every CP rank runs the vision tower on all the batch's images (the tower is not split); under sequence
parallelism the packed embeddings are scattered over the TP ranks as Megatron-Core's embedding scatters its own.
A pipeline stage without the embedding (``pre_process=False``) skips steps 1-2 and takes its input through
``set_input_tensor``.  The model reads as the language model does where packfwd's forwards look (``config``,
``pre_process``, ``post_process``, ``output_layer``, ``vocab_size``, ``pg_collection``, ``position_embedding_type``).

Qwen3.5 (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): the same steps with its vision
tower (no deepstack features: transformers 5.x's Qwen3.5 tower returns the merged features only), its hybrid
language model (Gated DeltaNet layers, and gated full-attention layers with interleaved multimodal RoPE over their
partial rotary channels) and its positions (each video frame an item of its own: ``split_video_frames=True``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rope_index import mrope_position_ids

__all__ = ["VisionLanguageModel", "from_hf"]


class VisionLanguageModel(torch.nn.Module):
    """``visual`` (transformers' Qwen2-VL / Qwen2.5-VL / Qwen3.5 vision tower) + ``language_model`` (packfwd's
    multimodal-RoPE ``PackedGPTModel``), called as ``model(input_ids, position_ids, attention_mask,
    packed_seq_params=None, packing=..., pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
    video_grid_thw=None, second_per_grid_ts=None, **language_model_kwargs)`` (steps in the module docstring).

    ``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``spatial_merge_size``,
    ``tokens_per_second`` (Qwen2.5-VL; None for Qwen2-VL): as in the HF config; ``split_video_frames`` (Qwen3.5:
    each video frame its own item of positions, :func:`packfwd.vision.mrope_position_ids`); :func:`from_hf` reads
    them.
    """

    def __init__(self, visual: torch.nn.Module, language_model: torch.nn.Module, *, image_token_id: int,
                 video_token_id: int, vision_start_token_id: int, spatial_merge_size: int = 2,
                 tokens_per_second: float | None = None, split_video_frames: bool = False):
        super().__init__()
        if getattr(language_model, "position_embedding_type", None) != "mrope":
            raise ValueError("language_model must be a multimodal-RoPE model (ModelArgs(mrope_section=...), e.g. "
                             "packfwd.models.convert.hf_vl.language_model_from_hf)")
        self.visual = visual
        self.language_model = language_model
        self.token_ids = dict(image_token_id=image_token_id, video_token_id=video_token_id,
                              vision_start_token_id=vision_start_token_id)
        self.spatial_merge_size = spatial_merge_size
        self.tokens_per_second = tokens_per_second
        self.split_video_frames = split_video_frames

    # the language model's facts, where packfwd's forwards (and verl's) read them
    config = property(lambda self: self.language_model.config)
    pre_process = property(lambda self: self.language_model.pre_process)
    post_process = property(lambda self: self.language_model.post_process)
    vocab_size = property(lambda self: self.language_model.vocab_size)
    pg_collection = property(lambda self: self.language_model.pg_collection)
    output_layer = property(lambda self: getattr(self.language_model, "output_layer", None))
    position_embedding_type = property(lambda self: self.language_model.position_embedding_type)  # "mrope"

    def set_input_tensor(self, tensor) -> None:
        self.language_model.set_input_tensor(tensor)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None, *,
                packed_seq_params=None, packing=None, pixel_values: Tensor | None = None,
                image_grid_thw: Tensor | None = None, pixel_values_videos: Tensor | None = None,
                video_grid_thw: Tensor | None = None, second_per_grid_ts: Tensor | None = None, **kwargs):
        if packing is None:
            raise ValueError(
                "VisionLanguageModel packs the embeddings it merges with the `packing` hook: call it through "
                "packfwd.make_forward(..., vision=True) or packfwd.verl.model_forward_gen(vision_model=True), or pass "
                "packing=packfwd.forward.vision.VisionPacking(plan) with the plan of the batch"
            )
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if position_ids is None:
            position_ids, _ = mrope_position_ids(
                input_ids, mask, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                second_per_grid_ts=second_per_grid_ts, spatial_merge_size=self.spatial_merge_size,
                tokens_per_second=self.tokens_per_second, split_video_frames=self.split_video_frames,
                **self.token_ids)
        hidden = None
        if self.language_model.pre_process:
            merged = self.embed(input_ids, mask, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
            # contiguous, as Megatron-Core's embedding returns it (BSHD's [s_c, b, h] is a transpose; its MoE
            # dispatcher views the hidden states flat)
            hidden = _scatter_sequence_parallel(packing.embeddings(merged).contiguous(), self.language_model)
        return self.language_model(None, packing.positions(position_ids), None, decoder_input=hidden,
                                   packed_seq_params=packed_seq_params, **kwargs)

    def embed(self, input_ids: Tensor, mask: Tensor, pixel_values=None, image_grid_thw=None,
              pixel_values_videos=None, video_grid_thw=None) -> Tensor:
        """``[b, s, h]``: the token embeddings with the image (video) tokens' replaced by the vision features, in
        order (the k-th image token of the batch, rows in order, takes the k-th feature row)."""
        x = _embed_tokens(self.language_model.embedding.word_embeddings, input_ids)
        for pixels, grid, token, kind in ((pixel_values, image_grid_thw, "image_token_id", "image"),
                                          (pixel_values_videos, video_grid_thw, "video_token_id", "video")):
            where = (input_ids == self.token_ids[token]) & mask
            if pixels is None:
                if bool(where.any()):
                    raise ValueError(f"input_ids holds {kind} tokens but no {kind} pixels were given; pass "
                                     f"{'pixel_values' if kind == 'image' else 'pixel_values_videos'} and its grid")
                continue
            features = self.vision_features(pixels, grid).to(x.dtype)
            if int(where.sum()) != features.shape[0]:
                raise ValueError(f"input_ids holds {int(where.sum())} real {kind} tokens but the vision tower gave "
                                 f"{features.shape[0]} {kind} features; the grids and the tokens must match")
            x = x.masked_scatter(where[..., None], features)
        return x

    def vision_features(self, pixels: Tensor, grid: Tensor) -> Tensor:
        """``[n, h]``: transformers' vision tower (patch merger included) on ``pixels`` of the items of ``grid``."""
        dtype = next(self.visual.parameters()).dtype
        out = self.visual(pixels.to(dtype), grid_thw=grid)
        return getattr(out, "pooler_output", out)  # transformers 5.x: merged features; 4.x: a tensor


def _embed_tokens(embedding, input_ids: Tensor) -> Tensor:
    """``[b, s] -> [b, s, h]`` with Megatron's ``VocabParallelEmbedding``, whole on every TP rank.  Under
    sequence parallelism Megatron-Core's lookup reduce-scatters over the tokens; the merge needs every token, so
    this rank's vocabulary slice is looked up and summed over the TP ranks instead."""
    if not getattr(embedding, "reduce_scatter_embeddings", False):
        return embedding(input_ids)
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    outside = (input_ids < embedding.vocab_start_index) | (input_ids >= embedding.vocab_end_index)
    local = torch.nn.functional.embedding((input_ids - embedding.vocab_start_index).masked_fill(outside, 0),
                                          embedding.weight)
    return reduce_from_tensor_model_parallel_region(local.masked_fill(outside[..., None], 0.0),
                                                    group=embedding.tp_group)


def _scatter_sequence_parallel(hidden: Tensor, model) -> Tensor:
    """This TP rank's slice of the tokens under sequence parallelism (as Megatron-Core's embedding scatters)."""
    if not model.config.sequence_parallel:
        return hidden
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(hidden, group=model.pg_collection.tp)


def from_hf(hf_model: torch.nn.Module, **kwargs) -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` of a transformers ``Qwen2VLForConditionalGeneration`` /
    ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` /
    ``Qwen3_5MoeForConditionalGeneration``: its vision tower (the same module, not a copy) and its language model
    converted (:func:`packfwd.models.convert.hf_vl.language_model_from_hf`, which ``kwargs`` go to: TP, pipeline stage,
    device, dtype, attention backend).  A vision tower with deepstack features (``deepstack_visual_indexes``: Qwen3-VL,
    features added into early decoder layers) is refused; Qwen3.5's has none.

    >>> import packfwd as pf
    >>> from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    >>> cfg = Qwen2VLConfig(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                      num_attention_heads=2, num_key_value_heads=1,
    ...                                      rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
    ...                     vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2),
    ...                     image_token_id=60, video_token_id=61, vision_start_token_id=62)
    >>> model = from_hf(Qwen2VLForConditionalGeneration(cfg).eval())
    >>> ids = torch.tensor([[5, 62, 60, 7, 0], [6, 62, 60, 8, 9]])      # an image of one token per row
    >>> grid, pixels = torch.tensor([[1, 2, 2], [1, 2, 2]]), torch.randn(8, 3 * 2 * 14 * 14)
    >>> out = pf.make_forward("thd", vision=True)(model, ids, ids != 0, multi_modal_inputs=dict(
    ...     pixel_values=pixels, image_grid_thw=grid))
    >>> out.shape
    torch.Size([2, 5, 64])
    """
    from packfwd.models.convert.hf_vl import language_model_from_hf

    config = hf_model.config
    inner = getattr(hf_model, "model", None)
    visual = getattr(inner, "visual", None) or getattr(hf_model, "visual", None)  # transformers 5.x, 4.x
    if visual is None:
        raise ValueError(f"{type(hf_model).__name__} has no vision tower (model.visual); pass the whole "
                         "Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration / "
                         "Qwen3_5ForConditionalGeneration")
    vision = config.vision_config
    if getattr(vision, "deepstack_visual_indexes", None):
        raise ValueError(f"vision_config.deepstack_visual_indexes={list(vision.deepstack_visual_indexes)}: this vision "
                         "tower adds deepstack features into early decoder layers (Qwen3-VL), which packfwd's language "
                         "model does not take; packfwd packs Qwen2-VL, Qwen2.5-VL and Qwen3.5 (no deepstack)")
    qwen3_5 = getattr(config, "model_type", None) in ("qwen3_5", "qwen3_5_moe")
    return VisionLanguageModel(
        visual, language_model_from_hf(hf_model, **kwargs), image_token_id=config.image_token_id,
        video_token_id=config.video_token_id, vision_start_token_id=config.vision_start_token_id,
        spatial_merge_size=vision.spatial_merge_size, tokens_per_second=getattr(vision, "tokens_per_second", None),
        split_video_frames=qwen3_5,
    )
