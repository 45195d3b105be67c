package e2e

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	rabbithole "github.com/michaelklishin/rabbit-hole/v2"
	amqp "github.com/rabbitmq/amqp091-go"
)

// The management API through rabbit-hole, the Go client operators and Terraform's RabbitMQ
// provider use: declare, list, bind, publish over AMQP, read the counts, close a connection,
// delete. Each answer is decoded into rabbit-hole's own types, so a field of the wrong JSON type
// fails here.
func TestManagementAPIWithRabbitHole(t *testing.T) {
	amqpPort, httpPort := startBrokerWithHTTP(t)
	rmq, err := rabbithole.NewClient(fmt.Sprintf("http://127.0.0.1:%d", httpPort), "guest", "guest")
	if err != nil {
		t.Fatal(err)
	}

	overview, err := rmq.Overview()
	if err != nil {
		t.Fatalf("overview: %v", err)
	}
	if overview.RabbitMQVersion == "" || overview.Node == "" {
		t.Fatalf("overview lacks version or node: %+v", overview)
	}
	if who, err := rmq.Whoami(); err != nil || who.Name != "guest" {
		t.Fatalf("whoami: %+v %v", who, err)
	}
	nodes, err := rmq.ListNodes()
	if err != nil || len(nodes) != 1 || !nodes[0].IsRunning {
		t.Fatalf("nodes: %+v %v", nodes, err)
	}
	vhosts, err := rmq.ListVhosts()
	if err != nil || len(vhosts) != 1 || vhosts[0].Name != "/" {
		t.Fatalf("vhosts: %+v %v", vhosts, err)
	}
	if users, err := rmq.ListUsers(); err != nil || len(users) != 1 {
		t.Fatalf("users: %+v %v", users, err)
	}
	if perms, err := rmq.ListPermissions(); err != nil || len(perms) != 1 {
		t.Fatalf("permissions: %+v %v", perms, err)
	}

	const q, qq, ex = "rh-classic", "rh-quorum", "rh-topic"
	mustStatus(t, "declare queue")(rmq.DeclareQueue("/", q, rabbithole.QueueSettings{Durable: true, Arguments: map[string]interface{}{"x-max-length": 500}}))
	mustStatus(t, "declare quorum queue")(rmq.DeclareQueue("/", qq, rabbithole.QueueSettings{Type: "quorum", Durable: true}))
	mustStatus(t, "declare exchange")(rmq.DeclareExchange("/", ex, rabbithole.ExchangeSettings{Type: "topic", Durable: true}))
	mustStatus(t, "declare binding")(rmq.DeclareBinding("/", rabbithole.BindingInfo{Source: ex, Destination: q, DestinationType: "queue", RoutingKey: "a.#"}))
	mustStatus(t, "declare binding")(rmq.DeclareBinding("/", rabbithole.BindingInfo{Source: ex, Destination: qq, DestinationType: "queue", RoutingKey: "#"}))

	conn, err := amqp.Dial(fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", amqpPort))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 100))
	for i := 0; i < 40; i++ {
		if err := ch.Publish(ex, "a.b", false, false, amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte("m")}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 40; i++ {
		if c := <-confirms; !c.Ack {
			t.Fatalf("publish %d nacked", i)
		}
	}

	waitFor(t, "queue counts", func() bool {
		a, errA := rmq.GetQueue("/", q)
		b, errB := rmq.GetQueue("/", qq)
		return errA == nil && errB == nil && a.Messages == 40 && b.Messages == 40 && b.Type == "quorum" && a.Arguments["x-max-length"] != nil
	})
	queues, err := rmq.ListQueues()
	if err != nil || len(queues) != 2 {
		t.Fatalf("queues: %+v %v", queues, err)
	}
	bindings, err := rmq.ListQueueBindings("/", q)
	if err != nil || len(bindings) != 2 { // the default exchange's and ours
		t.Fatalf("bindings of %s: %+v %v", q, bindings, err)
	}
	exchanges, err := rmq.ListExchangesIn("/")
	if err != nil || len(exchanges) < 7 {
		t.Fatalf("exchanges: %+v %v", exchanges, err)
	}

	conns, err := rmq.ListConnections()
	if err != nil || len(conns) != 1 || conns[0].Channels != 1 {
		t.Fatalf("connections: %+v %v", conns, err)
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	mustStatus(t, "close connection")(rmq.CloseConnection(conns[0].Name))
	select {
	case e := <-closed:
		if e == nil || e.Code != 320 {
			t.Fatalf("closed with %+v, want 320 CONNECTION_FORCED", e)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was not closed")
	}

	defs, err := rmq.ListDefinitions()
	if err != nil || defs.Queues == nil || len(*defs.Queues) != 2 || len(*defs.Exchanges) != 1 || len(*defs.Bindings) != 2 {
		t.Fatalf("definitions: %+v %v", defs, err)
	}

	mustStatus(t, "purge")(rmq.PurgeQueue("/", q))
	mustStatus(t, "delete queue")(rmq.DeleteQueue("/", q))
	mustStatus(t, "delete queue")(rmq.DeleteQueue("/", qq))
	mustStatus(t, "delete exchange")(rmq.DeleteExchange("/", ex))
	if _, err := rmq.GetQueue("/", q); err == nil {
		t.Fatal("the deleted queue is still there")
	} else if e, ok := err.(rabbithole.ErrorResponse); !ok || e.StatusCode != http.StatusNotFound {
		t.Fatalf("a deleted queue: %v, want 404", err)
	}
}

// mustStatus fails the test unless the call succeeded with a 2xx status.
func mustStatus(t *testing.T, what string) func(*http.Response, error) {
	return func(res *http.Response, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if res.StatusCode/100 != 2 {
			t.Fatalf("%s: status %d", what, res.StatusCode)
		}
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 15 s", what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
