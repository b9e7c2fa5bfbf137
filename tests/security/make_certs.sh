#!/bin/sh
# Test PKI for the security tests, made fresh at test time with openssl (nothing secret is
# checked in): a CA, a worker, a node and two client certificates signed by it, and a rogue CA
# whose certificate claims the worker's name. Every leaf carries SANs DNS:localhost and
# IP:127.0.0.1 (servers are dialled at 127.0.0.1) plus DNS:<its name>, and both serverAuth and
# clientAuth (the worker is a server to clients and a client to nodes).
#
# usage: make_certs.sh DIR    -> DIR/{ca,worker,node,client-a,client-b,rogue}.{pem,key}
set -eu
dir=$1
mkdir -p "$dir"
cd "$dir"

ca() {  # name
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=$1" -keyout "$1.key" -out "$1.pem" 2>/dev/null
}

leaf() {  # name ca
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=$1" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$1" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca
ca rogue-ca
leaf tandem-worker ca
leaf tandem-node ca
leaf client-a ca
leaf client-b ca
# Same name as the worker, another CA: must fail every handshake.
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=tandem-worker" -keyout rogue.key -out rogue.csr 2>/dev/null
printf 'subjectAltName=DNS:tandem-worker,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >rogue.ext
openssl x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey rogue-ca.key -CAcreateserial -days 2 \
  -extfile rogue.ext -out rogue.pem 2>/dev/null
rm -f rogue.csr rogue.ext
