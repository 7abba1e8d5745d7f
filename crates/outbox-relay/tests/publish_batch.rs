//! `publish_batch` against the real RabbitMQ (`AMQP_URL`, started by `make
//! test`): every message of a batch gets exactly one outcome, also when the
//! deadline cuts the batch off. A message without one would stay leased,
//! unmarked and unretried, until its lease ran out.

use std::collections::HashSet;
use std::time::Duration;

use lapin::{
    options::{ConfirmSelectOptions, ExchangeDeleteOptions},
    BasicProperties,
};
use outbox_relay::publish::{publish_batch, Message, PublishFailure};
use uuid::Uuid;

#[tokio::test]
async fn a_batch_cut_off_by_its_deadline_still_has_one_outcome_per_message() {
    let settings = kit::settings::AmqpSettings {
        url: std::env::var("AMQP_URL")
            .unwrap_or_else(|_| kit::settings::AmqpSettings::default().url),
    };
    let connection = kit::amqp::connect(
        &settings,
        "publish-batch-test",
        &kit::CancellationToken::new(),
    )
    .await
    .expect("connect to RabbitMQ");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let exchange = format!("publish-batch-test-{}", Uuid::new_v4());
    kit::amqp::declare_topic_exchange(&channel, &exchange)
        .await
        .expect("exchange");

    // 5,000 messages (unroutable: nothing is bound) and a deadline that has
    // already passed when the batch is handed over. The broker takes far
    // longer than the batch's two polls to confirm them all, so most get
    // no confirm in time: they must come back as timeouts, not go missing.
    let messages: Vec<(Message, tracing::Span)> = (0..5_000)
        .map(|_| {
            let message = Message {
                event_id: Uuid::new_v4(),
                routing_key: "publish.batch.test".to_owned(),
                body: vec![b'x'; 400],
                properties: BasicProperties::default(),
            };
            (message, tracing::Span::none())
        })
        .collect();
    let ids: HashSet<Uuid> = messages.iter().map(|(m, _)| m.event_id).collect();
    let outcomes = publish_batch(&channel, &exchange, messages, Duration::ZERO).await;

    assert_eq!(outcomes.len(), ids.len(), "one outcome per message");
    let got: HashSet<Uuid> = outcomes.iter().map(|o| o.event_id).collect();
    assert_eq!(got, ids, "every message of the batch, none other");
    let timeouts = outcomes
        .iter()
        .filter(|o| matches!(o.result, Err(PublishFailure::Timeout)))
        .count();
    let returned = outcomes
        .iter()
        .filter(|o| matches!(o.result, Err(PublishFailure::Returned(_))))
        .count();
    assert_eq!(
        timeouts + returned,
        ids.len(),
        "only timeouts or (confirmed in time) returns: {timeouts} timeouts, {returned} returns"
    );
    assert!(timeouts > 0, "the deadline cut the batch off");

    let _ = channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    let _ = connection.close(200, "done".into()).await;
}
