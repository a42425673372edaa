// Command etcd is upstream etcd's server entry point, built from the pinned
// go.etcd.io/etcd/server/v3 module (the etcd binary's own main lives in a
// module that is not published for `go build`, so we call etcdmain here).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
