/* LD_PRELOAD shim: listeners that bind the wildcard address bind the worker's host instead.
 *
 * Why: Mooncake's Transfer Engine (P2P handshake) binds its handshake daemon and its TCP data
 * port to INADDR_ANY / in6addr_any, and its API has no bind address. A worker configured to
 * listen on 127.0.0.1 must not be reachable on every interface, so the worker process loads
 * this shim (transfer/bind_host.py builds it and sets the environment) and every bind() to a
 * wildcard address with a port inside TANDEM_BIND_PORTS (the range Mooncake draws its ports
 * from, MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) binds TANDEM_BIND_HOST instead. Binds outside the
 * range (torch.distributed's store, ephemeral client sockets) are left as they are.
 *
 * IPv6 sockets (asio's dual-stack acceptor) get the v4-mapped form ::ffff:a.b.c.d of an IPv4
 * host, which a dual-stack socket accepts; an IPv6 host is used as given.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int in_range(unsigned port) {
    const char *range = getenv("TANDEM_BIND_PORTS"); /* "LO-HI" */
    if (range == NULL) return 0;
    char *end = NULL;
    unsigned long lo = strtoul(range, &end, 10);
    if (end == NULL || *end != '-') return 0;
    unsigned long hi = strtoul(end + 1, NULL, 10);
    return port >= lo && port <= hi;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("TANDEM_BIND_HOST");
    if (host == NULL || *host == '\0' || addr == NULL) return real(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY) && in_range(ntohs(in4.sin_port)) &&
            inet_pton(AF_INET, host, &in4.sin_addr) == 1)
            return real(fd, (const struct sockaddr *)&in4, sizeof in4);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        struct in_addr v4;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr) && in_range(ntohs(in6.sin6_port))) {
            if (inet_pton(AF_INET6, host, &in6.sin6_addr) == 1)
                return real(fd, (const struct sockaddr *)&in6, sizeof in6);
            if (inet_pton(AF_INET, host, &v4) == 1) {
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&in6.sin6_addr.s6_addr[12], &v4, sizeof v4);
                return real(fd, (const struct sockaddr *)&in6, sizeof in6);
            }
        }
    }
    return real(fd, addr, len);
}
