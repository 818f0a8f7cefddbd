using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>Bad input gets a clear error and loses nothing: never acknowledged unprocessed.</summary>
public class BadInputTests : PostgresRabbitTest
{
    [Fact]
    public async Task Consume_MessageWithoutMessageId_IsFaultedToTheErrorQueueWithTheReason()
    {
        string queue = Queue("noid");
        var counter = new DeliveryCounter();
        await StartConsumerHostAsync<EffectConsumer>(queue, counter);

        // A raw AMQP publisher that set neither the message_id property nor the envelope's messageId.
        string envelope = """{"messageType":["urn:message:ExactlyOnce.TestHost:TestMessage"],"message":{"value":7}}""";
        await RabbitAdmin.PublishRawAsync(queue, envelope, messageId: null);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_error") == 1, "moved to the error queue");

        Assert.Equal(0, Probe.TotalEntries);
        var faulted = await RabbitAdmin.GetAsync(queue + "_error");
        Assert.NotNull(faulted);
        Assert.Contains("has no message id", faulted.Value.Headers["MT-Fault-Message"], StringComparison.Ordinal);
        Assert.Contains(nameof(MessageIdMissingException), faulted.Value.Headers["MT-Fault-ExceptionType"], StringComparison.Ordinal);
    }
}

/// <summary>A database where the inbox migration was never applied.</summary>
public class MissingInboxTableTests : PostgresRabbitTest
{
    protected override bool CreateInboxTable => false;

    [Fact]
    public async Task Consume_InboxTableMissing_FaultsWithAnErrorThatNamesTheMigration_AndRunsNoConsumer()
    {
        string queue = Queue("notable");
        var counter = new DeliveryCounter();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter);
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_error") == 1, "moved to the error queue");

        Assert.Equal(0, Probe.TotalEntries);
        var faulted = await RabbitAdmin.GetAsync(queue + "_error");
        Assert.NotNull(faulted);
        Assert.Equal(id.ToString(), faulted.Value.MessageId);
        string reason = faulted.Value.Headers["MT-Fault-Message"];
        Assert.Contains("inbox table 'inbox_messages' does not exist", reason, StringComparison.Ordinal);
        Assert.Contains("dotnet ef migrations add AddExactlyOnceInbox", reason, StringComparison.Ordinal);
    }
}
