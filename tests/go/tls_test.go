package e2e

// AMQPS with amqp091-go: certificates made here with crypto/x509 (a CA, a server certificate for
// localhost and 127.0.0.1, a client certificate), the broker started with --tls-cert/--tls-key/--tls-ca;
// DialTLS trusting only the test's CA, 100 messages published with confirms and consumed, each
// counted; EXTERNAL with the client certificate as the user named by its subject.
//
//   cd tests/go && WARREN_BIN=/tmp/warren-tls/warren go test ./... -run TLS -count=1

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

type testPKI struct {
	caPool            *x509.CertPool
	caFile            string
	serverCert        *x509.Certificate
	certFile, keyFile string
	client            tls.Certificate
	clientDN          string // the user name EXTERNAL logs in as (RabbitMQ's formatting)
	otherPool         *x509.CertPool
}

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func serial(t *testing.T) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func selfSignedCA(t *testing.T, cn string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{Organization: []string{"Warren Tests"}, CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 365 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func makePKI(t *testing.T) *testPKI {
	t.Helper()
	dir := t.TempDir()
	p := &testPKI{}
	ca, caKey := selfSignedCA(t, "Warren Go Test CA")
	p.caPool = x509.NewCertPool()
	p.caPool.AddCert(ca)
	p.caFile = filepath.Join(dir, "ca.pem")
	writePEM(t, p.caFile, "CERTIFICATE", ca.Raw)
	other, _ := selfSignedCA(t, "Another CA")
	p.otherPool = x509.NewCertPool()
	p.otherPool.AddCert(other)

	// Server: SAN DNS:localhost, IP:127.0.0.1; its key in SEC1 ("EC PRIVATE KEY").
	skey := newKey(t)
	stmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{Organization: []string{"Warren Go Server"}, CommonName: "localhost"},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	sder, err := x509.CreateCertificate(rand.Reader, stmpl, ca, &skey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	if p.serverCert, err = x509.ParseCertificate(sder); err != nil {
		t.Fatal(err)
	}
	p.certFile, p.keyFile = filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key")
	writePEM(t, p.certFile, "CERTIFICATE", sder)
	sec1, err := x509.MarshalECPrivateKey(skey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, p.keyFile, "EC PRIVATE KEY", sec1)

	// Client: C=GB, O=Warren Tests, OU=QA, CN=go-client in issuing order (Go writes a pkix.Name's
	// fields in that order), so RabbitMQ's name for it is the reverse.
	ckey := newKey(t)
	ctmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject: pkix.Name{Country: []string{"GB"}, Organization: []string{"Warren Tests"},
			OrganizationalUnit: []string{"QA"}, CommonName: "go-client"},
		NotBefore:   time.Now().Add(-time.Hour),
		NotAfter:    time.Now().Add(365 * 24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	cder, err := x509.CreateCertificate(rand.Reader, ctmpl, ca, &ckey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	p.client = tls.Certificate{Certificate: [][]byte{cder}, PrivateKey: ckey}
	p.clientDN = "CN=go-client,OU=QA,O=Warren Tests,C=GB"
	return p
}

// freePorts returns n distinct free ports (all held open until each is chosen).
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ls []net.Listener
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// startTLSBroker starts the broker with TLS on free ports; returns the AMQPS and plain HTTP ports.
func startTLSBroker(t *testing.T, p *testPKI) (amqpsPort, httpPort int) {
	t.Helper()
	ports := freePorts(t, 3)
	_, httpPort = startBrokerArgs(t,
		"--tls-cert", p.certFile, "--tls-key", p.keyFile, "--tls-ca", p.caFile,
		"--amqps-port", fmt.Sprint(ports[0]), "--https-port", fmt.Sprint(ports[1]),
		"--prometheus-tls-port", fmt.Sprint(ports[2]))
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", ports[0]), 200*time.Millisecond)
		if err == nil {
			c.Close()
			return ports[0], httpPort
		}
		if time.Now().After(deadline) {
			t.Fatalf("the AMQPS port %d never accepted: %v", ports[0], err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func publishConfirmConsume(t *testing.T, conn *amqp.Connection, queue string, n int) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatalf("queue declare: %v", err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatalf("confirm.select: %v", err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, n+1))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; i < n; i++ {
		// Every tenth body is 100 KB: several TLS records.
		body := []byte(fmt.Sprintf("tls-%05d", i))
		if i%10 == 5 {
			body = append(body, bytes.Repeat([]byte{'x'}, 100_000)...)
		}
		if err := ch.PublishWithContext(ctx, "", queue, true, false, amqp.Publishing{DeliveryMode: amqp.Persistent, Body: body}); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	seen := make(map[uint64]bool, n)
	timeout := time.After(30 * time.Second)
	for len(seen) < n {
		select {
		case c, ok := <-confirms:
			if !ok {
				t.Fatalf("confirm channel closed after %d confirms", len(seen))
			}
			if !c.Ack {
				t.Fatalf("nack for delivery tag %d", c.DeliveryTag)
			}
			if seen[c.DeliveryTag] || c.DeliveryTag < 1 || c.DeliveryTag > uint64(n) {
				t.Fatalf("unexpected or duplicate confirm for delivery tag %d", c.DeliveryTag)
			}
			seen[c.DeliveryTag] = true
		case <-timeout:
			t.Fatalf("timed out waiting for confirms: %d of %d", len(seen), n)
		}
	}

	if err := ch.Qos(20, 0, false); err != nil {
		t.Fatalf("qos: %v", err)
	}
	deliveries, err := ch.Consume(queue, "tls-consumer", false, false, false, false, nil)
	if err != nil {
		t.Fatalf("consume: %v", err)
	}
	timeout = time.After(30 * time.Second)
	for i := 0; i < n; i++ {
		select {
		case d, ok := <-deliveries:
			if !ok {
				t.Fatalf("deliveries closed after %d of %d", i, n)
			}
			want := fmt.Sprintf("tls-%05d", i)
			if !strings.HasPrefix(string(d.Body), want) || (i%10 == 5) != (len(d.Body) > 100_000) {
				t.Fatalf("delivery %d: got %.20q (%d bytes), want %q", i, d.Body, len(d.Body), want)
			}
			if err := d.Ack(false); err != nil {
				t.Fatalf("ack %d: %v", i, err)
			}
		case <-timeout:
			t.Fatalf("timed out consuming: %d of %d", i, n)
		}
	}
	select {
	case d := <-deliveries:
		t.Fatalf("a delivery past the last: %.20q", d.Body)
	case <-time.After(300 * time.Millisecond):
	}
}

func TestTLSPublishConfirmConsume(t *testing.T) {
	p := makePKI(t)
	port, _ := startTLSBroker(t, p)
	for _, version := range []uint16{tls.VersionTLS12, tls.VersionTLS13} {
		cfg := &tls.Config{RootCAs: p.caPool, ServerName: "localhost", MinVersion: version, MaxVersion: version}
		conn, err := amqp.DialTLS(fmt.Sprintf("amqps://guest:guest@127.0.0.1:%d/", port), cfg)
		if err != nil {
			t.Fatalf("DialTLS (version %x): %v", version, err)
		}
		state := conn.ConnectionState()
		if state.Version != version || len(state.PeerCertificates) == 0 || !state.PeerCertificates[0].Equal(p.serverCert) {
			t.Fatalf("TLS state: version %x (want %x), %d peer certificates", state.Version, version, len(state.PeerCertificates))
		}
		publishConfirmConsume(t, conn, fmt.Sprintf("go-tls-%x", version), 100)
		if err := conn.Close(); err != nil {
			t.Fatalf("close: %v", err)
		}
	}
	// A client trusting another CA refuses the server.
	if conn, err := amqp.DialTLS(fmt.Sprintf("amqps://guest:guest@127.0.0.1:%d/", port), &tls.Config{RootCAs: p.otherPool, ServerName: "localhost"}); err == nil {
		conn.Close()
		t.Fatal("DialTLS trusting another CA connected")
	}
}

func TestTLSExternalAuth(t *testing.T) {
	p := makePKI(t)
	port, httpPort := startTLSBroker(t, p)
	u := url.PathEscape(p.clientDN)
	for _, put := range []struct{ path, body string }{
		{"/api/users/" + u, `{"password":"x","tags":""}`},
		{"/api/permissions/%2F/" + u, `{"configure":".*","write":".*","read":".*"}`},
	} {
		req, err := http.NewRequest(http.MethodPut, fmt.Sprintf("http://127.0.0.1:%d%s", httpPort, put.path), strings.NewReader(put.body))
		if err != nil {
			t.Fatal(err)
		}
		req.SetBasicAuth("guest", "guest")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("PUT %s: %v", put.path, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusNoContent {
			t.Fatalf("PUT %s: %s", put.path, resp.Status)
		}
	}
	cfg := &tls.Config{RootCAs: p.caPool, ServerName: "localhost", Certificates: []tls.Certificate{p.client}}
	conn, err := amqp.DialTLS_ExternalAuth(fmt.Sprintf("amqps://127.0.0.1:%d/", port), cfg)
	if err != nil {
		t.Fatalf("EXTERNAL as %q: %v", p.clientDN, err)
	}
	defer conn.Close()
	publishConfirmConsume(t, conn, "go-tls-external", 100)
}
