// AMQPS with the RabbitMQ Java client (the one in PerfTest's lib, scripts/install-perftest.sh):
// trusts only the CA in a PEM file (read into an in-memory KeyStore), checks the server's host name,
// publishes N messages with confirms, consumes them with manual acks and checks each arrived once.
// Exit code 0 when every message was confirmed and consumed exactly once, 1 otherwise.
//
//   java -cp "$HOME/.cache/warren/perftest/lib/*" tests/java/TlsCheck.java HOST PORT CA.pem N [HOSTNAME]
//
// Run by tests/python/test_tls.py.
import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import com.rabbitmq.client.DefaultConsumer;
import com.rabbitmq.client.Envelope;

import java.io.FileInputStream;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.security.KeyStore;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.util.Collection;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import javax.net.ssl.SSLContext;
import javax.net.ssl.SSLSocket;
import javax.net.ssl.TrustManagerFactory;

public class TlsCheck {
    public static void main(String[] args) throws Exception {
        if (args.length < 4) {
            System.err.println("usage: TlsCheck HOST PORT CA.pem N [HOSTNAME]");
            System.exit(2);
        }
        String host = args[0];
        int port = Integer.parseInt(args[1]);
        String caPath = args[2];
        int n = Integer.parseInt(args[3]);

        KeyStore trust = KeyStore.getInstance(KeyStore.getDefaultType());
        trust.load(null, null);
        try (InputStream in = new FileInputStream(caPath)) {
            Collection<? extends Certificate> cas = CertificateFactory.getInstance("X.509").generateCertificates(in);
            if (cas.isEmpty()) {
                throw new IllegalStateException("no certificate in " + caPath);
            }
            int i = 0;
            for (Certificate c : cas) {
                trust.setCertificateEntry("ca-" + i++, c);
            }
        }
        TrustManagerFactory tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        tmf.init(trust);
        SSLContext tls = SSLContext.getInstance("TLS");
        tls.init(null, tmf.getTrustManagers(), null);

        ConnectionFactory cf = new ConnectionFactory();
        cf.setHost(host);
        cf.setPort(port);
        cf.setUsername("guest");
        cf.setPassword("guest");
        cf.useSslProtocol(tls);
        cf.enableHostnameVerification();
        cf.setAutomaticRecoveryEnabled(false);
        cf.setConnectionTimeout(10_000);
        cf.setHandshakeTimeout(10_000);

        String queue = "java-tls-" + System.nanoTime();
        try (Connection conn = cf.newConnection("TlsCheck")) {
            Channel pub = conn.openChannel().orElseThrow();
            pub.queueDeclare(queue, true, false, false, null);
            pub.confirmSelect();
            AtomicInteger acked = new AtomicInteger();
            AtomicInteger nacked = new AtomicInteger();
            pub.addConfirmListener(
                (tag, multiple) -> acked.incrementAndGet(),
                (tag, multiple) -> nacked.incrementAndGet());
            for (int i = 0; i < n; i++) {
                byte[] body = ("java-tls-" + i).getBytes(StandardCharsets.UTF_8);
                pub.basicPublish("", queue, true, new AMQP.BasicProperties.Builder().deliveryMode(2).build(), body);
            }
            // Throws on a nack or a timeout.
            pub.waitForConfirmsOrDie(30_000);
            if (nacked.get() != 0) {
                System.err.println("nacked: " + nacked.get());
                System.exit(1);
            }

            Channel sub = conn.openChannel().orElseThrow();
            sub.basicQos(100);
            ConcurrentHashMap<String, Integer> seen = new ConcurrentHashMap<>();
            CountDownLatch done = new CountDownLatch(n);
            AtomicInteger extra = new AtomicInteger();
            sub.basicConsume(queue, false, new DefaultConsumer(sub) {
                @Override
                public void handleDelivery(String tag, Envelope env, AMQP.BasicProperties props, byte[] body) throws java.io.IOException {
                    String s = new String(body, StandardCharsets.UTF_8);
                    if (seen.merge(s, 1, Integer::sum) > 1) {
                        extra.incrementAndGet();
                    }
                    sub.basicAck(env.getDeliveryTag(), false);
                    done.countDown();
                }
            });
            if (!done.await(30, TimeUnit.SECONDS)) {
                System.err.println("consumed " + (n - done.getCount()) + " of " + n);
                System.exit(1);
            }
            int missing = 0;
            for (int i = 0; i < n; i++) {
                if (!seen.containsKey("java-tls-" + i)) {
                    missing++;
                }
            }
            if (missing != 0 || extra.get() != 0 || seen.size() != n) {
                System.err.println("missing " + missing + ", duplicates " + extra.get() + ", distinct " + seen.size());
                System.exit(1);
            }
            String protocol = "?";
            if (conn instanceof com.rabbitmq.client.impl.AMQConnection) {
                // The socket's negotiated protocol, to show TLS was used.
                java.lang.reflect.Field f = null;
                try {
                    Object delegate = conn;
                    f = com.rabbitmq.client.impl.AMQConnection.class.getDeclaredField("_frameHandler");
                    f.setAccessible(true);
                    Object fh = f.get(delegate);
                    java.lang.reflect.Field s = fh.getClass().getDeclaredField("_socket");
                    s.setAccessible(true);
                    Object sock = s.get(fh);
                    if (sock instanceof SSLSocket) {
                        protocol = ((SSLSocket) sock).getSession().getProtocol();
                    }
                } catch (ReflectiveOperationException | RuntimeException e) {
                    protocol = "unknown (" + e.getClass().getSimpleName() + ")";
                }
            }
            pub.queueDelete(queue);
            System.out.println("confirmed " + n + " (" + acked.get() + " basic.ack), consumed " + seen.size() + " of " + n + " over " + protocol);
        }
        System.exit(0);
    }
}
