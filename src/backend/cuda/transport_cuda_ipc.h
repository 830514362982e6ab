/*
 * The CUDA IPC data-plane transport (transport.h) for KV pools in GPU memory (issue 10, last
 * scope bullet): two worker processes on one host, each with its KV pool in HBM, move blocks
 * GPU to GPU without touching host memory.
 *
 *   exposing side (context worker): expose(base, len) publishes cudaIpcGetMemHandle of the
 *     device allocation that starts at base (the CUDA backend's pool is one cudaMalloc), with
 *     the GPU's UUID, the length, the host's identity (boot id + host name) and its pid.
 *   reading side (generation worker): connect() checks that the peer runs on this host and
 *     that its GPU is visible here, then opens the handle once (cudaIpcOpenMemHandle with
 *     cudaIpcMemLazyEnablePeerAccess, so a peer on another GPU of the host is read over
 *     NVLink / PCIe peer access); the mapping stays until disconnect. A read() turns its
 *     fragments into device-to-device copies on the transport's own stream: the fragments are
 *     merged where contiguous on both sides (runs), and one gather-kernel launch per 1024 runs
 *     copies them: the kernel cuts the runs into chunks of one CTA each (about 4096 chunks per
 *     read, 16 KiB .. 1 MiB) and copies with 16-byte vector loads, 8 in flight per thread (byte
 *     copies for a chunk whose addresses or length are not 16-byte aligned); up to 128 runs
 *     pass 3 KiB of launch parameters, more 24 KiB; a CUDA event recorded after them is
 *     polled by progress(), which reports the read's completion. Nothing on the host waits for
 *     the copy.
 *   A descriptor from this very process (pid equal, same host) is not opened (CUDA refuses to
 *   open a handle in the process that made it): the exporter's pointer is used as it is.
 *
 * Descriptor (little-endian, one record for region 0; expose_staging is not offered):
 *   "KVXC" | u8 version (1) | u8 region (0) | u16 0 | u32 pid | u32 0 | u64 base (exporter's
 *   address) | u64 len | u64 offset of base in the allocation (0) | u8 gpu_uuid[16] |
 *   char boot_id[40] | char host[64] | cudaIpcMemHandle_t (64 bytes) | u64 FNV-1a of all before
 *
 * Errors: connect refuses (KV_EINVAL, with a message) a descriptor of another transport, a bad
 * checksum, a peer on another host ("CUDA IPC works between processes of one host"), a GPU that
 * is not visible in this process (CUDA_VISIBLE_DEVICES); KV_EIO when CUDA refuses to open the
 * handle (its error string). A copy that fails (a CUDA error at launch or on the event) fails
 * the read with KV_EIO; a sticky CUDA error leaves the transport unusable (every later read
 * KV_EIO), as it leaves the backend.
 *
 * Experiment knobs (read at creation; docs/benchmarks.md has the figures):
 * KVSERVE_CUDA_IPC_CTAS=N sets the chunks a read aims at (default 4096);
 * KVSERVE_CUDA_IPC_COPY=batch copies the runs with one cudaMemcpyBatchAsync instead (as fast
 * as cudaMemcpyAsync for one contiguous run, 3-5x slower than the kernel for scattered 2 MiB
 * blocks on the H200).
 *
 * Threading: as transport.h (one thread drives an instance); every call sets the transport's
 * device on the calling thread first. destroy() waits for copies still in flight (a stream
 * synchronisation) before it closes the mappings.
 */
#ifndef KV_BACKEND_CUDA_TRANSPORT_CUDA_IPC_H
#define KV_BACKEND_CUDA_TRANSPORT_CUDA_IPC_H

#ifdef __cplusplus
extern "C" {
#endif

#include "../../transfer/transport.h"

/* Creates a CUDA IPC transport on CUDA device `device` (the device of the local pool; reads
 * run on a stream of it). KV_EUNSUPPORTED (message) when the device cannot be used, KV_ENOMEM,
 * KV_EIO (CUDA error). *out untouched on failure. */
kv_status kvx_transport_cuda_ipc_new(int device, kvx_transport_t **out, char *err, size_t errlen);

/* This host's identity as the descriptor carries it ("<boot id>/<host name>"), for messages
 * and tests. */
void kvx_cuda_ipc_host_id(char *out, size_t outlen);

#ifdef __cplusplus
}
#endif
#endif
