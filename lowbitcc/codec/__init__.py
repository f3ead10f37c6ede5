"""The codec: the wire format, the reference arithmetic and its fused implementations.

`wire` (message and call-descriptor layout), `formats` (the code formats, one record each),
`reference` (the pure-torch specification), `error_state` (the stored error's layout), `abi`
(what the kernels share, read from ``csrc/loco_codec.cuh``), `interface` (what an
implementation offers), `kernels` (the reference implementation and the choice of one), `cpu`
and `cuda` (the C++ and CUDA implementations), `shard_codec` (framing and validation of shard
messages). Imports nothing of the backend, schedules or transports.
"""
