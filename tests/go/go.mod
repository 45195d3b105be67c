module warren.test/e2e

go 1.22

require github.com/rabbitmq/amqp091-go v1.16.0

require github.com/michaelklishin/rabbit-hole/v2 v2.16.0
