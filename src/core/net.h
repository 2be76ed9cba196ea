/* This host's network interfaces, as the cluster's configuration names them: which interface
 * carries an address (its name, for UCX_NET_DEVICES; its network in CIDR form, for Open MPI's
 * btl_tcp_if_include, which matches interfaces by network), and whether an address is this
 * host's at all (pdmoe up --hosts: which instances run here). */
#ifndef PD_CORE_NET_H
#define PD_CORE_NET_H

#include "core/err.h"

#include <stddef.h>

struct pd_net_iface {
    char name[64];     /* "e0", "enp67s0f0np0"; "" for a wildcard address (0.0.0.0, ::) */
    char cidr[64];     /* the interface's network: "198.18.0.0/24"; "" for a wildcard */
};

/* The interface of this host that carries `addr` (a numeric address or a name that resolves to
 * one). PD_EINVAL naming `what` and the address when it does not resolve or no interface of this
 * host carries it (a cluster file naming another host's address, a typo). */
int pd_net_iface_of(const char *addr, const char *what, struct pd_net_iface *out, pd_err *e);

/* 1 when `addr` is an address of this host (loopback included), 0 when it is not or does not
 * resolve. */
int pd_net_is_local(const char *addr);

#endif
