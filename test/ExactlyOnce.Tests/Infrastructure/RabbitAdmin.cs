using System.Text;
using ExactlyOnce.TestHost;
using RabbitMQ.Client;

namespace ExactlyOnce.Tests.Infrastructure;

/// <summary>Looks at RabbitMQ directly (not through MassTransit): queue depths and the error queue's contents.</summary>
public static class RabbitAdmin
{
    private static async Task<T> WithChannelAsync<T>(Func<IChannel, Task<T>> action)
    {
        var factory = new ConnectionFactory { Uri = TestHosts.RabbitMq };
        await using var connection = await factory.CreateConnectionAsync();
        await using var channel = await connection.CreateChannelAsync();
        return await action(channel);
    }

    /// <summary>Ready messages in <paramref name="queue"/>; 0 if it does not exist.</summary>
    public static async Task<uint> CountAsync(string queue)
    {
        try
        {
            return await WithChannelAsync(async ch => (await ch.QueueDeclarePassiveAsync(queue)).MessageCount);
        }
        catch (RabbitMQ.Client.Exceptions.OperationInterruptedException)
        {
            return 0;
        }
    }

    /// <summary>Takes one message off <paramref name="queue"/> and returns its headers as strings and its message id.</summary>
    public static Task<(string? MessageId, Dictionary<string, string> Headers)?> GetAsync(string queue) =>
        WithChannelAsync<(string?, Dictionary<string, string>)?>(async ch =>
        {
            BasicGetResult? result = await ch.BasicGetAsync(queue, autoAck: true);
            if (result is null)
            {
                return null;
            }

            var headers = new Dictionary<string, string>();
            foreach (var (key, value) in result.BasicProperties.Headers ?? new Dictionary<string, object?>())
            {
                headers[key] = value switch
                {
                    byte[] bytes => Encoding.UTF8.GetString(bytes),
                    null => "",
                    _ => value.ToString() ?? "",
                };
            }

            return (result.BasicProperties.MessageId, headers);
        });

    /// <summary>What an operator's re-drive does: moves one message, body and properties untouched, from one queue to another.</summary>
    public static Task<bool> MoveAsync(string from, string to) =>
        WithChannelAsync(async ch =>
        {
            BasicGetResult? result = await ch.BasicGetAsync(from, autoAck: false);
            if (result is null)
            {
                return false;
            }

            await ch.BasicPublishAsync("", to, mandatory: false, new BasicProperties(result.BasicProperties), result.Body);
            await ch.BasicAckAsync(result.DeliveryTag, multiple: false);
            return true;
        });

    /// <summary>Publishes a raw body straight to a queue (default exchange), bypassing MassTransit.</summary>
    public static Task<bool> PublishRawAsync(string queue, string body, string? messageId, string contentType = "application/vnd.masstransit+json") =>
        WithChannelAsync(async ch =>
        {
            var props = new BasicProperties { ContentType = contentType, MessageId = messageId, Persistent = true };
            await ch.BasicPublishAsync("", queue, mandatory: false, props, Encoding.UTF8.GetBytes(body));
            return true;
        });

    public static async Task DeleteAsync(IEnumerable<string> queues)
    {
        try
        {
            await WithChannelAsync(async ch =>
            {
                foreach (string queue in queues)
                {
                    await ch.QueueDeleteAsync(queue);
                    await ch.ExchangeDeleteAsync(queue);
                }

                return true;
            });
        }
        catch (Exception)
        {
            // Best effort: a fresh machine starts empty anyway.
        }
    }
}
