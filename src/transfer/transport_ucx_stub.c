/* The UCX transport's entry points in a build without UCX (transport.h). */
#ifndef KVSERVE_HAVE_UCX
#include "transport.h"

bool kvx_transport_ucx_available(void) { return false; }

kv_status kvx_transport_ucx_new(const char *host, kvx_transport_t **out, char *err, size_t errlen) {
    (void)host;
    (void)out;
    return kv_errf(KV_EUNSUPPORTED, err, errlen, "this build has no UCX transport (install "
                   "libucx-dev and rebuild)");
}
#else
typedef int kvx_transport_ucx_stub_unused;
#endif
