#!/usr/bin/env bash
# Download RabbitMQ PerfTest (com.rabbitmq:perf-test) and its runtime dependencies
# into ${WARREN_CACHE:-$HOME/.cache/warren}/perftest/lib. Idempotent.
# Run with: java -cp "$DIR/lib/*" com.rabbitmq.perf.PerfTest --help
set -euo pipefail
PERFTEST_VERSION=${PERFTEST_VERSION:-2.22.1}
DIR="${WARREN_CACHE:-$HOME/.cache/warren}/perftest"
JAR="$DIR/lib/perf-test-$PERFTEST_VERSION.jar"
if [ -f "$JAR" ]; then
  echo "perf-test $PERFTEST_VERSION already installed in $DIR/lib"
  exit 0
fi
command -v mvn >/dev/null || { echo "mvn (Maven) is required" >&2; exit 1; }
mkdir -p "$DIR"
cat > "$DIR/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.warren</groupId>
  <artifactId>perftest-runner</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>com.rabbitmq</groupId>
      <artifactId>perf-test</artifactId>
      <version>$PERFTEST_VERSION</version>
    </dependency>
  </dependencies>
</project>
POM
rm -rf "$DIR/lib.tmp"
(cd "$DIR" && mvn -q -B dependency:copy-dependencies -DoutputDirectory=lib.tmp)
rm -rf "$DIR/lib"
mv "$DIR/lib.tmp" "$DIR/lib"
[ -f "$JAR" ] || { echo "install failed: $JAR missing" >&2; exit 1; }
echo "perf-test $PERFTEST_VERSION installed in $DIR/lib ($(ls "$DIR/lib" | wc -l) jars)"
