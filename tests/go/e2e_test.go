package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const numMessages = 2000

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startBroker launches the warren binary on free ports with a temp data dir
// and returns the AMQP port. The broker is killed via t.Cleanup.
func startBroker(t *testing.T) int {
	t.Helper()
	amqpPort, _ := startBrokerWithHTTP(t)
	return amqpPort
}

// startBrokerWithHTTP is startBroker, also returning the management API's port.
func startBrokerWithHTTP(t *testing.T) (int, int) {
	t.Helper()
	return startBrokerArgs(t)
}

// startBrokerArgs is startBrokerWithHTTP with more server flags (e.g. TLS's) after the usual ones.
func startBrokerArgs(t *testing.T, extra ...string) (int, int) {
	t.Helper()
	bin := os.Getenv("WARREN_BIN")
	if bin == "" {
		bin = filepath.Join("..", "..", "target", "release", "warren")
	}
	bin, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("warren binary not found at %s (build with `cargo build --release` or set WARREN_BIN): %v", bin, err)
	}
	amqpPort, httpPort := freePort(t), freePort(t)
	for httpPort == amqpPort {
		httpPort = freePort(t)
	}
	dataDir := t.TempDir()
	logPath := filepath.Join(t.TempDir(), "warren.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"server",
		"--amqp-port", fmt.Sprint(amqpPort),
		"--http-port", fmt.Sprint(httpPort),
		"--prometheus-port", "0",
		"--data-dir", dataDir}
	cmd := exec.Command(bin, append(args, extra...)...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		t.Fatalf("start broker: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		logFile.Close()
		if t.Failed() {
			if b, err := os.ReadFile(logPath); err == nil {
				t.Logf("broker log:\n%s", b)
			}
		}
	})

	addr := fmt.Sprintf("127.0.0.1:%d", amqpPort)
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("broker exited early: %v", err)
		default:
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return amqpPort, httpPort
		}
		if time.Now().After(deadline) {
			t.Fatalf("broker did not accept connections on %s: %v", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestPublishConfirmConsume(t *testing.T) {
	port := startBroker(t)
	url := fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port)

	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()

	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()

	const qname = "go-e2e-durable"
	if _, err := ch.QueueDeclare(qname, true, false, false, false, nil); err != nil {
		t.Fatalf("queue declare: %v", err)
	}

	// --- publish with confirms ---
	if err := ch.Confirm(false); err != nil {
		t.Fatalf("confirm.select: %v", err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, numMessages+1))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := 0; i < numMessages; i++ {
		err := ch.PublishWithContext(ctx, "", qname, true, false, amqp.Publishing{
			DeliveryMode: amqp.Persistent,
			ContentType:  "text/plain",
			Body:         []byte(fmt.Sprintf("msg-%06d", i)),
		})
		if err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}

	acked, nacked := 0, 0
	seen := make(map[uint64]bool, numMessages)
	timeout := time.After(30 * time.Second)
	for acked+nacked < numMessages {
		select {
		case c, ok := <-confirms:
			if !ok {
				t.Fatalf("confirm channel closed after %d acks, %d nacks", acked, nacked)
			}
			if seen[c.DeliveryTag] {
				t.Fatalf("duplicate confirm for delivery tag %d", c.DeliveryTag)
			}
			seen[c.DeliveryTag] = true
			if c.Ack {
				acked++
			} else {
				nacked++
			}
		case <-timeout:
			t.Fatalf("timed out waiting for confirms: %d acked, %d nacked of %d", acked, nacked, numMessages)
		}
	}
	if nacked != 0 || acked != numMessages {
		t.Fatalf("confirms: %d acked, %d nacked, want %d acked", acked, nacked, numMessages)
	}
	for tag := uint64(1); tag <= numMessages; tag++ {
		if !seen[tag] {
			t.Fatalf("missing confirm for delivery tag %d", tag)
		}
	}

	q, err := ch.QueueDeclarePassive(qname, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("passive declare: %v", err)
	}
	if q.Messages != numMessages {
		t.Errorf("queue has %d messages after publishing, want %d", q.Messages, numMessages)
	}

	// --- consume with manual acks, prefetch 100 ---
	cch, err := conn.Channel()
	if err != nil {
		t.Fatalf("consumer channel: %v", err)
	}
	defer cch.Close()
	if err := cch.Qos(100, 0, false); err != nil {
		t.Fatalf("qos: %v", err)
	}
	deliveries, err := cch.Consume(qname, "go-e2e-consumer", false, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume: %v", err)
	}
	received := 0
	counts := make(map[string]int, numMessages)
	timeout = time.After(60 * time.Second)
	for received < numMessages {
		select {
		case d, ok := <-deliveries:
			if !ok {
				t.Fatalf("delivery channel closed after %d messages", received)
			}
			body := string(d.Body)
			want := fmt.Sprintf("msg-%06d", received)
			if body != want {
				t.Fatalf("delivery %d: got body %q, want %q (out of order or lost)", received, body, want)
			}
			counts[body]++
			if d.Redelivered {
				t.Errorf("delivery %d unexpectedly marked redelivered", received)
			}
			if err := d.Ack(false); err != nil {
				t.Fatalf("ack %d: %v", received, err)
			}
			received++
		case <-timeout:
			t.Fatalf("timed out consuming: got %d of %d", received, numMessages)
		}
	}
	for body, n := range counts {
		if n != 1 {
			t.Errorf("body %q delivered %d times", body, n)
		}
	}
	if len(counts) != numMessages {
		t.Errorf("got %d distinct bodies, want %d", len(counts), numMessages)
	}

	// No extra deliveries should arrive.
	select {
	case d := <-deliveries:
		t.Errorf("unexpected extra delivery: %q", d.Body)
	case <-time.After(300 * time.Millisecond):
	}

	if err := cch.Cancel("go-e2e-consumer", false); err != nil {
		t.Fatalf("basic.cancel: %v", err)
	}

	// Acks are async; poll briefly for the count to reach zero.
	var last int = -1
	deadline := time.Now().Add(5 * time.Second)
	for {
		q, err := ch.QueueDeclarePassive(qname, true, false, false, false, nil)
		if err != nil {
			t.Fatalf("passive declare after consume: %v", err)
		}
		last = q.Messages
		if last == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if last != 0 {
		t.Fatalf("queue has %d messages after consuming and acking all, want 0", last)
	}
}
